"""The consume loop: fetching, the in-flight cap, partitions held and why, rebalances, shutdown."""
