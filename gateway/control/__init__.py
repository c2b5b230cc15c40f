"""The control loop: what the gateway learns from its own traffic and how it steers routing.

``target`` holds the router threshold to a long-tier share; ``drift`` watches the score and tier mix against
the router's reference; ``outcomes`` stores the labels (feedback, escalations, shadow comparisons) that
``thinkgate router retrain --from-outcomes`` learns from; ``shadow`` re-asks a sample of predicted requests on
the next tier up and records whether the answers agree (``shadow_references`` checks against known answers).
"""
