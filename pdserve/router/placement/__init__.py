"""Where a request runs: the prefix index, the routing policies and the P/D rule, behind one
entry point (placement.Placement.place). Pure: no sockets, nodes come in as views."""
