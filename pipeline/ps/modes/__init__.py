"""How updates combine (``ps.mode``): the consistency modes and their server policies, staleness rules,
learning-rate schedules and push compression."""
