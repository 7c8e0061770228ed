"""The control plane: commands from the control topic applied to a worker, answers on the status topic."""
