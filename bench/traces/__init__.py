"""Recorded reasoning traces through the real gateway: the replay upstream and ``thinkgate bench traces``."""
