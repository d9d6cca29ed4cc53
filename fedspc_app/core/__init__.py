"""What both sides of a run agree on: the run-config, the errors, atomic files, the
message protocol and its records, the methods' descriptions and FedSPC's reference
arithmetic (Algorithm 1). Free of torch; imports nothing else of the project."""
