"""Quality evaluations run through the engine (``kvserve eval …``)."""
