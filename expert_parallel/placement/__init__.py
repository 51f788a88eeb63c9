"""Expert placement, offline: recorded load, its forecast, the tuner and its evaluation, the
placement files and the router's map (pure numpy), and the `placement` command."""
