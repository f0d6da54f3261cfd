"""Chains (`--turns all`): advancing a conversation's next turn once the turn before it
finishes (`advance.py`), in a worker's background thread (`advancer.py`), with each run's
pinned tokenizer (`tokenizers.py`). The chain's items are planned at enqueue by
workers/intake/turns.py; this part may import workers/intake and app/, never the engine or
control.
"""
