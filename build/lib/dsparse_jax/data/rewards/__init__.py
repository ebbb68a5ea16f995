"""Rewards: the built-in graders (graders.py), users' reward functions (user.py) and the
`Rewarder` that combines them (rewarder.py)."""
