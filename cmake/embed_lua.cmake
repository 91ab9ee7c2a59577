# Turns a Lua source file into a C header holding it as a byte array.
# Usage: cmake -DIN=<file.lua> -DOUT=<header.h> -DNAME=<c identifier> -P embed_lua.cmake
file(READ "${IN}" hex HEX)
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
string(REGEX REPLACE "(0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,)" "\\1\n  " bytes "${bytes}")
get_filename_component(src_name "${IN}" NAME)
file(WRITE "${OUT}.tmp"
  "/* Generated from ${src_name} by cmake/embed_lua.cmake; do not edit. */\n"
  "static const char ${NAME}[] = {\n  ${bytes}0x00\n};\n")
file(COPY_FILE "${OUT}.tmp" "${OUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUT}.tmp")
