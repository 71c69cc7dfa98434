"""Graders of the mixture-of-experts family: routers, balancing losses, capacity, expert choice, the MoE layer and
upcycling. One test module per problem; routing_checks and speed_cases are what several use."""
