"""Names both sides of a message agree on: query kinds and reply metrics.

The ClientApp writes them and the strategies read them; keeping them here gives each
one home below both (``clients/`` and ``strategies/`` do not import each other).
"""

# Query messages (``MessageType.QUERY``), by their ``config["query"]``.
PARTITION_QUERY = "partition"  # load this node's partition; report its class counts
NODE_QUERY = "node"  # report this node's partition id only (nothing is loaded)

# Reply metrics.
PARTITION_ID = "partition-id"
SHARED_STEPS = "shared-steps"  # optimizer steps that updated the shared block (FedSPC's E)
LOCAL_CORRECT, LOCAL_EXAMPLES = "local-correct", "local-examples"  # before aggregation
SETUP_SECONDS, WORK_SECONDS = "setup-seconds", "work-seconds"
