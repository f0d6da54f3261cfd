"""The generate engine beside one GPU: the claim logic behind the Celery task, the worker's runtime,
and the in-flight window with its parts (backlog, room, slots, timer, writer, heartbeat, hedges,
conversation groups), each owning its own state."""
