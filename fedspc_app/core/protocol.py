"""Names both sides of a message agree on: query kinds and reply metrics.

The ClientApp writes them and the strategies read them; keeping them here gives each
one home below both (``clients/`` and ``strategies/`` do not import each other).
"""

# Query messages (``MessageType.QUERY``), by their ``config["query"]``.
PARTITION_QUERY = "partition"  # load this node's partition; report its class counts
NODE_QUERY = "node"  # report this node's partition id only (nothing is loaded)
# A simulation's first message to each node, sent while the server loads its own data:
# start the worker process, import the ClientApp, load the data and build the model.
WARM_UP_QUERY = "warm-up"

# Reply metrics.
PARTITION_ID = "partition-id"
SHARED_STEPS = "shared-steps"  # optimizer steps that updated the shared block (FedSPC's E)
LOCAL_CORRECT, LOCAL_EXAMPLES = "local-correct", "local-examples"  # before aggregation
# A personal-model method's evaluation of the received global model (evaluate-global-model).
GLOBAL_CORRECT, GLOBAL_EXAMPLES = "global-correct", "global-examples"
SETUP_SECONDS, WORK_SECONDS = "setup-seconds", "work-seconds"
# On the first message a ClientApp process handles, and only then: wall-clock epochs of
# the process's start and of that handler's start. The server turns them into how
# long new workers took to come up (strategies.rounds.worker_startup); meaningful
# where server and clients share a clock (a simulation, one machine).
PROCESS_STARTED_AT, HANDLER_STARTED_AT = "process-started-at", "handler-started-at"
# With them: when the process began and finished importing the ClientApp module
# (its imports: torch, the methods, the data code).
APP_IMPORT_STARTED_AT, APP_IMPORTED_AT = "app-import-started-at", "app-imported-at"
