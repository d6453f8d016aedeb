"""`mileage serve`: the in-process engine behind SGLang's native HTTP API (`server.py`), every
request field checked in one place (`requests.py`), weight transfer over a collective
(`broadcast.py`) and LoRA adapters loaded at run time (`lora.py`)."""
