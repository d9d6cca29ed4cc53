"""Process launchers shared by the simulation CLI, the experiment runner, the
benchmarks and the deployment scripts: owned child processes, a private
SuperLink, ``flwr run`` submissions and run-config files."""
