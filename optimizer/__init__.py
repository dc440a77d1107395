"""The control plane: statistics, profiles, the Aggregate LLM Pipeline, search, placement, rollout."""
