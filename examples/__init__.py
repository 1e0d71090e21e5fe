"""Examples of tierkv in use; a package so that ``python -m examples.server`` runs from the repo root."""
