"""How many nodes of each role: the admin scaler, the SLA planner loop, the registry watcher."""
