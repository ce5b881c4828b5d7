"""Worked examples of agent code for `task=agent`: each is a function `run(client, example) -> reward` that
uses only the `openai` client it is given (none of them imports ringrl), as agent code written anywhere would.
"""
