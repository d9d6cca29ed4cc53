"""Server strategies (Flower ``flwr.serverapp.strategy.Strategy`` subclasses).

* :class:`PersonalizedFedAvg` aggregates only the shared block of a method.
* :class:`FedSPC` is one that also keeps the global drift reference u_bar; with
  every parameter shared it is SCAFFOLD.
* :class:`AggregationRule` (the mean, or a rule a few lying clients cannot steer)
  and :class:`ServerOptimizer` (Flower's FedAvgM/FedAdam/FedYogi/FedAdagrad step on
  the shared block) compose with both.
"""

from strategies.aggregation import AggregationRule, mean_arrays
from strategies.dp_release import Privacy
from strategies.fedspc import FedSPC
from strategies.personalized import PersonalizedFedAvg, RoundReport
from strategies.rounds import TooManyFailedRounds, run_rounds
from strategies.server_optimizer import ServerOptimizer

__all__ = ["AggregationRule", "FedSPC", "PersonalizedFedAvg", "Privacy", "RoundReport",
           "ServerOptimizer", "TooManyFailedRounds", "mean_arrays", "run_rounds"]
