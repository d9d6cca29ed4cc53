"""FedSPC: shared-parameter correction for personalized federated learning, as a Flower app."""

import time as _time

IMPORT_STARTED_AT = _time.time()
"""When this process began importing the package (a wall-clock epoch): in a
simulation's worker, the start of loading the ClientApp (see
``fedspc_app.core.startup.first_message_times``)."""
