"""A deterministic simulation of a worker fleet on Apache Kafka's rules: the real worker code on
simulated clients, a simulated cluster and a virtual clock, one seed driving every choice, and a
checker over what the clients saw (`worker.dev.sim.run`)."""
