"""Names both sides of a message agree on: record keys, config keys, query kinds and
reply metrics.

The server side (strategies, ServerApp, deployment checks) writes and reads them, and
so does the ClientApp; keeping them here gives each one home below both
(``clients/`` and ``strategies/`` do not import each other, and the ClientApp imports
no strategy). The arrays themselves travel as :mod:`fedspc_app.core.records`.
"""

# Records of a message's RecordDict.
ARRAYS = "arrays"  # ArrayRecord: the shared block (sent, and replied after training)
METRICS = "metrics"  # MetricRecord of a reply
CONFIG = "config"  # ConfigRecord of a server message
GLOBAL_REFERENCE = "global-reference"  # ArrayRecord: FedSPC's u_bar^t (train messages)
REFERENCE_CHANGE = "reference-change"  # ArrayRecord: u_k^{t+1} - u_k^t (explicit upload)
# ArrayRecord: FedSPC's u_k^t as the server keeps it (fedspc-reference = "server-centre"),
# which the client trains with in place of its own (train messages).
CLIENT_REFERENCE_RECORD = "client-reference"

# Keys of the ``config`` record.
SERVER_ROUND = "server-round"
ROUND_LEARNING_RATE = "learning-rate"  # the clients' η of this round (lr-schedule)
# Differential privacy with adaptive clipping: the clipping norm C_t of this round.
CLIPPING_NORM = "clipping-norm"
NUM_CLIENTS = "num-clients"  # K, the run's clients (queries and round messages)
QUERY = "query"  # the kind of a query message (below)
DEPLOYMENT = "deployment"  # a deployment run: the clients keep their state in files
REFERENCE_UPLOAD = "reference-upload"  # FedSPC: "explicit" asks for REFERENCE_CHANGE
# For every partition, the last round whose reply the server aggregated, and up to
# which round those decisions are in its checkpoint (see clients.state).
ACCEPTED_ROUNDS = "accepted-rounds"
DURABLE_THROUGH = "durable-through"
RUN_TOKEN = "run-token"  # tells a resumed run's clients from another run's leftovers
# The run name the server settled on (a new run may get a versioned one, <name>-2):
# the clients keep their state under that run's folder or name.
RUN_NAME = "run-name"
# Evaluation messages to a held-out client (held-out-clients): fine-tune the personal
# part from a new client's start, then test; nothing is kept. Its reply says so too.
HELD_OUT = "held-out"

# Query messages (``MessageType.QUERY``), by their ``config["query"]``.
PARTITION_QUERY = "partition"  # load this node's partition; report its class counts
NODE_QUERY = "node"  # report this node's partition id only (nothing is loaded)
# A simulation's first message to each node, sent while the server loads its own data:
# start the worker process, import the ClientApp, load the data and build the model.
WARM_UP_QUERY = "warm-up"

# Reply metrics.
PARTITION_ID = "partition-id"
# Training replies: the client's training examples (the aggregation weight, Flower's
# convention), the mean loss of its last epoch, the images its loop went through and
# the rounds it has trained so far. Evaluation replies: examples, correct predictions
# and summed loss on its test split.
NUM_EXAMPLES, TRAIN_LOSS = "num-examples", "train-loss"
EXAMPLES_SEEN, ROUNDS_TRAINED = "examples-seen", "rounds-trained"
CORRECT, LOSS_SUM = "correct", "loss-sum"
SHARED_STEPS = "shared-steps"  # optimizer steps that updated the shared block (FedSPC's E)
# Adaptive clipping on the clients: 1 when the update's norm was at most C_t, else 0.
WITHIN_CLIPPING_NORM = "within-clipping-norm"
LOCAL_CORRECT, LOCAL_EXAMPLES = "local-correct", "local-examples"  # before aggregation
# A personal-model method's evaluation of the received global model (evaluate-global-model).
GLOBAL_CORRECT, GLOBAL_EXAMPLES = "global-correct", "global-examples"
SETUP_SECONDS, WORK_SECONDS = "setup-seconds", "work-seconds"
# Optional reply metrics: a client's seconds spent on setup and on the work itself;
# the aggregates sum them over the clients (``client-setup-seconds`` and so on).
TIMINGS = (SETUP_SECONDS, WORK_SECONDS)
# On the first message a ClientApp process handles, and only then: wall-clock epochs of
# the process's start and of that handler's start. The server turns them into how
# long new workers took to come up (fedspc_app.core.startup.worker_startup); meaningful
# where server and clients share a clock (a simulation, one machine).
PROCESS_STARTED_AT, HANDLER_STARTED_AT = "process-started-at", "handler-started-at"
# With them: when the process began and finished importing the ClientApp module
# (its imports: torch, the methods, the data code).
APP_IMPORT_STARTED_AT, APP_IMPORTED_AT = "app-import-started-at", "app-imported-at"
