"""The engine loop: :mod:`.llm_engine` (schedule -> execute -> scheduler update -> output processor), :mod:`.async_engine`
(the asyncio front, its own thread), :mod:`.builder` (config -> ready engine), :mod:`.input_processor` (request
checks), :mod:`.output_processor` (detokenization, stop strings, usage, deltas) and :mod:`.detokenizer`."""
