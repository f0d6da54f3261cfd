"""The intake: prompts into the ledger and the queue (enqueue as a pipeline of stages, publishing
item ids) and the multi-turn chains whose later turns are templated as earlier ones finish."""
