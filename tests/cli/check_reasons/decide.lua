-- A hand-written decide for tests/cli/test_check_reasons.py: its reasons are
-- "decide" at the function's first line, and "fault" where it fails.
return {
  api = 1,
  name = "by-hand",
  decide = function(t)
    if t:class() == "SiLU" then error("no SiLU here") end
    if t.kind ~= ferry.ACTIVATION or t.bytes < 1024 then
      return ferry.KEEP, ferry.ON_USE, nil, true
    end
    return ferry.OFFLOAD, ferry.ON_USE, nil, true
  end,
}
