"""Expert rebalancing while serving (EPLB online): its settings, the plan of which weights move
where, and the manager that records, tunes, moves and switches."""
