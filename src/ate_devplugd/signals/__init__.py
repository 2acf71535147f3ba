"""What the daemon says of itself: sd_notify to systemd, and the metrics with the file node_exporter reads."""
