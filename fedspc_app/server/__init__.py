"""The ServerApp's helpers: the deployment's preflight, the simulation's warm-up and
the server's own evaluation of the shared model."""
