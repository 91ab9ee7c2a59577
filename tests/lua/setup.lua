-- setup.lua — puts bindings/lua and tests/lua/helpers on package.path for
-- the specs (run from the repository root: luajit /usr/bin/busted tests/lua).
local root = (debug.getinfo(1, "S").source:match("^@(.-)tests/lua/setup%.lua$") or "")
if root == "" then root = "./" end
for _, dir in ipairs({ "bindings/lua/?.lua", "tests/lua/helpers/?.lua" }) do
  local entry = root .. dir
  if not package.path:find(entry, 1, true) then package.path = entry .. ";" .. package.path end
end
return root
