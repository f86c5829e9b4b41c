"""The engine loop: :mod:`.llm_engine` (schedule -> execute -> scheduler.update_from_output -> output processor),
:mod:`.async_engine` (the asyncio front, its own thread), :mod:`.builder` (config -> ready engine, through the
executor), :mod:`.input_processor` (request checks), :mod:`.output_processor` (deltas and usage from the
scheduler's decisions)."""
