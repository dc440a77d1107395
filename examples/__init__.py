"""Agent apps written as users write them: the plain openai SDK pointed at a base_url."""
