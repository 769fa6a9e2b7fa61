"""Multi-LoRA (issue 18, in progress): PEFT adapters read and checked against the base model
(adapter.py), stacked into a fixed number of slots (slots.py), and applied per token inside the
forward (apply.py). Not yet wired into the engine, the scheduler or the server."""
