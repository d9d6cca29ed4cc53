"""Server strategies (Flower ``flwr.serverapp.strategy.Strategy`` subclasses).

* :class:`PersonalizedFedAvg` aggregates only the shared block of a method.
* :class:`FedSPC` is one that also keeps the global drift reference u_bar; with
  every parameter shared it is SCAFFOLD.
"""

from strategies.fedspc import FedSPC
from strategies.personalized import PersonalizedFedAvg, RoundReport, mean_arrays
from strategies.rounds import TooManyFailedRounds, run_rounds

__all__ = ["FedSPC", "PersonalizedFedAvg", "RoundReport", "TooManyFailedRounds",
           "mean_arrays", "run_rounds"]
