"""Multi-LoRA: PEFT adapters read and checked against the base model (adapter.py), stacked into a
fixed number of device slots (slots.py, device_slots.py), applied per token through slot one-hots
inside the forward (apply.py), and assigned to slots by the scheduler's slot table (slot_table.py)."""
