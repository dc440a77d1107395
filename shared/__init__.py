"""Contracts both sides use: settings, call records, the trace store. Imports nothing of ours."""
