"""Pure builders: each returns one whole manifest (or payload) for a job; no API calls, no clocks."""
