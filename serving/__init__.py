"""vLLM serving for PreFT adapters (plugin, scheduler, server): arrives with the serving issue."""
