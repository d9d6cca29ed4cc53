"""Server-side support for Flower's deployment engine (SuperLink and SuperNodes).

In a deployment the data lives on the SuperNodes. The server builds the model from
the dataset's known shape when the data is not on its machine, and before round 1
asks every SuperNode to load its own partition (a ``query`` message): a node that
cannot, two nodes with one partition id, or a node partitioning over another
number of clients stops the run with one message. The counts the nodes report
become the run's partition file.
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import INFO

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from fedspc_app.core.config import RunConfig
from fedspc_app.core.errors import FedSPCError
from fedspc_app.core.protocol import (
    CONFIG,
    METRICS,
    NUM_CLIENTS,
    PARTITION_QUERY,
    QUERY,
    RUN_NAME,
)
from fedspc_app.core.replies import one_line, partition_report_schema
from fedspc_app.data.datasets import ImageDataset
from fedspc_app.data.partition import partition_summary
from fedspc_app.data.run_data import KNOWN_SHAPES, DatasetShape, dataset_shape, load_run_dataset

try:  # the Grid Flower's deployment engine hands the ServerApp (not a public name)
    from flwr.superlink.grid import HttpGrid as _DeploymentGrid
except ImportError:  # pragma: no cover - a Flower without it: simulation semantics
    _DeploymentGrid = None

# Loading a partition can mean decoding a dataset (Tiny-ImageNet's first load).
PREFLIGHT_TIMEOUT = 3600.0


def is_deployment(grid: Grid) -> bool:
    """Whether the ServerApp runs in Flower's deployment engine rather than in simulation."""
    return _DeploymentGrid is not None and isinstance(grid, _DeploymentGrid)


def server_dataset(config: RunConfig, deployment: bool
                   ) -> tuple[DatasetShape, ImageDataset | None]:
    """The dataset's shape, and the dataset itself when this machine holds it.

    In simulation a dataset that cannot be loaded is an error (the clients would
    fail the same way). In a deployment the data usually lives on the clients only:
    the server looks for it without downloading it, and builds the model from the
    dataset's known shape when it is not there.
    """
    try:
        dataset = load_run_dataset(config.replace(download=False) if deployment else config)
    except FedSPCError as error:
        if not deployment:
            raise
        shape = KNOWN_SHAPES[config.dataset]
        log(INFO, "The %s data is not on the server (%s); building the model for its "
            "known shape (%d x %d x %d images, %d classes). The clients load the data.",
            config.dataset, error, shape.in_chans, shape.image_size, shape.image_size,
            shape.num_classes)
        return shape, None
    return dataset_shape(dataset), dataset


def preflight(grid: Grid, config: RunConfig, num_clients: int, shape: DatasetShape,
              timeout: float = PREFLIGHT_TIMEOUT) -> tuple[dict, dict[int, int]]:
    """Ask every connected SuperNode to load its partition; return the partition they
    report, and each node's partition id (the node is bound to it for the run).

    Raises
    ------
    FedSPCError
        Naming every problem: a node that failed (its error), no reply, a report
        that is not the schema's (:func:`fedspc_app.core.replies.partition_report_schema`),
        two nodes with one partition id, a partition id nobody has, or counts that
        do not fit the dataset.

    Returns
    -------
    dict
        Like :meth:`fedspc_app.data.partition.Partition.to_dict`, from the replies.
    dict[int, int]
        Node id -> the partition id it reported.
    """
    node_ids = sorted(grid.get_node_ids())
    messages = [
        Message(RecordDict({CONFIG: ConfigRecord({QUERY: PARTITION_QUERY,
                                                 NUM_CLIENTS: num_clients,
                                                 RUN_NAME: config.resolved_run_name})}),
                dst_node_id=node_id, message_type=MessageType.QUERY)
        for node_id in node_ids
    ]
    log(INFO, "Checking the %d connected SuperNodes (each loads its partition)...",
        len(node_ids))
    replies = list(grid.send_and_receive(messages, timeout=timeout))
    schema = partition_report_schema(num_clients, shape.num_classes)
    problems: list[str] = []
    rows: dict[int, tuple[int, Mapping]] = {}
    answered = set()
    for reply in replies:
        node = reply.metadata.src_node_id
        answered.add(node)
        if reply.has_error():
            problems.append(f"node {node}: {reply.error.reason}")
            continue
        reason = schema.check(reply)
        if reason is not None:
            counts = reply.content.metric_records.get(METRICS, {}).get("train-counts")
            if isinstance(counts, list) and len(counts) != shape.num_classes:
                reason = (f"it reports {len(counts)} classes, the {config.dataset} model "
                          f"has {shape.num_classes}")
            problems.append(f"node {node}: {one_line(reason)}")
            continue
        report = reply.content.metric_records[METRICS]
        partition_id = report["partition-id"]
        if partition_id in rows:
            problems.append(f"nodes {rows[partition_id][0]} and {node} both have "
                            f"partition-id={partition_id}")
            continue
        rows[partition_id] = (node, report)
    silent = sorted(set(node_ids) - answered)
    if silent:
        problems.append(f"no reply within {timeout:.0f} s from node(s) {silent}")
    missing = sorted(set(range(num_clients)) - set(rows))
    if missing and not problems:
        problems.append(f"no SuperNode has partition-id {missing}")
    if problems:
        raise FedSPCError("the deployment check failed: " + "; ".join(problems))
    for partition_id, (node, report) in sorted(rows.items()):
        log(INFO, "  partition %d on node %d: %d training / %d test images, client state %s",
            partition_id, node, sum(report["train-counts"]), sum(report["test-counts"]),
            "on the node's disk" if report["durable-state"] else "in memory only")
    summary = partition_summary(
        config.partition,
        alpha=config.alpha,
        classes_per_client=config.classes_per_client,
        seed=config.seed,
        tries=int(rows[0][1]["tries"]),
        train_counts=[list(rows[k][1]["train-counts"]) for k in range(num_clients)],
        test_counts=[list(rows[k][1]["test-counts"]) for k in range(num_clients)],
        held_out=config.held_out_clients,
    )
    nodes = {node: partition_id for partition_id, (node, _) in rows.items()}
    return {**summary, "source": "reported by the SuperNodes"}, nodes
