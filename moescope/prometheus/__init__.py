"""Live metrics: the Prometheus exporter, its alerting rules and the Grafana board."""
