"""The semantic cache: answers reused across near-identical questions (``cache.semantic``).

``policy`` splits a request into question and context and says what may be served; ``embed`` turns a question
into a vector; ``guard`` rejects near neighbours whose facts differ; ``index`` is the Redis vector index;
``cache`` ties them together for the pipeline.
"""
