"""The slot rings and their users: the guard and step clock, pools, the stager, the parameter table,
staged writes and the step batch."""
