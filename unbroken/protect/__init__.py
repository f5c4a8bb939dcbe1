"""protect"""
