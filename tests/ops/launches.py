"""Tests' view of which kernel variants run: a Triton kernel replaced by a spy that records the
constexprs each launch passes, then launches it as before."""


def record(monkeypatch, module, name: str, *fields: str) -> list:
    """Wrap module.name (a @triton.jit kernel launched as kernel[grid](...)); the list returned
    gets each launch's `fields` keyword values (a tuple, or the value alone for one field)."""
    launched, kernel = [], getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                values = tuple(kwargs[f] for f in fields)
                launched.append(values if len(fields) > 1 else values[0])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(module, name, Spy())
    return launched
