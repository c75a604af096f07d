"""`pdserve simulate`: the router's real policies and prefix index against modelled nodes."""
