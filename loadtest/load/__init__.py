"""Load tests: locust, soak, traffic, fault injection, large outputs."""
