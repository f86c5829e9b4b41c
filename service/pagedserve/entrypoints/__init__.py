"""Entry points: the server process (:mod:`.app`: both APIs, health, shutdown) that ``pagedserve serve`` runs."""
