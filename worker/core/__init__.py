"""What every side of the worker stands on: settings, errors, metrics, record limits, Kafka
clients, shutdown."""
