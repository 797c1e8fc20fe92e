"""Collectives that report errors instead of hanging: process groups, decisions every rank
agrees on (errors included), and the overlapped flag exchange.
"""
