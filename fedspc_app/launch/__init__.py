"""Process launchers shared by the simulation CLI, the experiment runner, the
benchmarks and the deployment scripts.

* :mod:`~fedspc_app.launch.processes`: owned child processes (:class:`OwnedProcess`,
  :func:`run_logged`), stopped with everything they started (:func:`stop_tree`);
  their environment (:func:`child_env`); :class:`LaunchFailed`.
* :mod:`~fedspc_app.launch.runconfig`: run-configs as users give them (a preset,
  then ``--set``), checked before anything starts.
* :mod:`~fedspc_app.launch.superlink`: a private SuperLink and runs submitted to it.
* :mod:`~fedspc_app.launch.cli`: what the command lines share (arguments, one-line
  errors).
"""
