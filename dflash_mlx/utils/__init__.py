"""Small helpers several layers share (`io`: atomic writes)."""
