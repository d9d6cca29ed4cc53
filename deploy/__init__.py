"""Running the FedSPC app on real machines with Flower's deployment engine.

* :mod:`deploy.pki`: a private CA, the SuperLink's TLS certificate and SuperNode
  authentication keys (``python -m deploy.pki --help``).
* :mod:`deploy.connection`: the ``flwr`` CLI's SuperLink connection in
  ``$FLWR_HOME/config.toml``.
* :mod:`deploy.processes`: SuperLink, SuperNode and Ray head processes owned by the
  caller and always stopped by PID (used by the tests and by :mod:`deploy.loopback`).
* :mod:`deploy.loopback`: the whole deployment on this machine, for a first try
  and for timing.

The shell scripts beside this package (``start-superlink.sh``,
``start-supernode.sh``, ``register-supernode.sh``, ``run.sh``) are what an operator
runs on each machine; docs/deployment.md walks through them.
"""
