"""The calls: the public collectives, the one entry they go through, and the plan of a call."""
