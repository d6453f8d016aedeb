"""Test harnesses shipped with mileage, so that users can check their own setups the same way.

`mileage.testing.crash` runs `mileage train` under SIGKILLs and compares the result, tensor by
tensor, with an uninterrupted run.
"""
