# Checks libpsclient's dynamic symbol table: it exports its public API and nothing else.
#   cmake -DLIB=<path to libpsclient.so> -DNM=<nm> -P exported_symbols_test.cmake
#
# Allowed (demangled, from `nm -D --defined-only -C`):
#   psclient::... and psd::...                                  the API marked PSD_EXPORT
#   typeinfo / typeinfo name / vtable / VTT / guard variable for, and thunks to, psclient:: or psd::
#   _init _fini _edata _end __bss_start                           what older binutils put in every
#                                                                 shared object's .dynsym (none with
#                                                                 Debian 12's ld; allowed by name only)
# Refused with their own message, whatever else: capnp:: kj:: boost:: fmt:: asio:: spdlog:: and
# psclient::internal:: (Cap'n Proto, KJ, Asio, fmt must stay private to the library; internals are
# not API). Anything else defined is refused too (a std:: template instantiation made visible, say).
if(NOT LIB OR NOT NM)
  message(FATAL_ERROR "usage: cmake -DLIB=libpsclient.so -DNM=nm -P exported_symbols_test.cmake")
endif()
execute_process(COMMAND ${NM} -D --defined-only -C ${LIB}
  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${NM} -D --defined-only -C ${LIB} failed (${rc}): ${err}")
endif()
string(REPLACE ";" "\\;" out "${out}")
string(REPLACE "\n" ";" lines "${out}")
set(bad_third_party "")
set(bad_internal "")
set(bad_other "")
set(count 0)
foreach(line IN LISTS lines)
  if(line STREQUAL "")
    continue()
  endif()
  # "<address> <type letter> <name>"; the name may contain spaces.
  string(REGEX REPLACE "^[0-9a-fA-F]* *[A-Za-z] " "" name "${line}")
  math(EXPR count "${count} + 1")
  set(ns "${name}")
  string(REGEX REPLACE "^(typeinfo name for|typeinfo for|vtable for|VTT for|guard variable for|non-virtual thunk to|virtual thunk to|covariant return thunk to) " "" ns "${ns}")
  if(ns MATCHES "(^|[^A-Za-z0-9_])(capnp|kj|boost|fmt|asio|spdlog)::")
    list(APPEND bad_third_party "${name}")
  elseif(ns MATCHES "^psclient::internal::")
    list(APPEND bad_internal "${name}")
  elseif(ns MATCHES "^(psclient|psd)::")
    # the public API
  elseif(name MATCHES "^(_init|_fini|_edata|_end|__bss_start)$")
    # toolchain
  else()
    list(APPEND bad_other "${name}")
  endif()
endforeach()
if(count EQUAL 0)
  message(FATAL_ERROR "${LIB} defines no dynamic symbols: is it the right file?")
endif()
set(report "")
foreach(kind IN ITEMS bad_third_party bad_internal bad_other)
  list(LENGTH ${kind} n)
  if(n GREATER 0)
    list(JOIN ${kind} "\n  " joined)
    string(APPEND report "${kind} (${n}):\n  ${joined}\n")
  endif()
endforeach()
if(report)
  message(FATAL_ERROR "${LIB} exports symbols outside its public API (psclient::, psd::); mark the API "
                      "with PSD_EXPORT and keep the rest hidden (client/CMakeLists.txt, client/psclient.map):\n${report}")
endif()
message(STATUS "${LIB}: ${count} exported symbols, all in psclient:: or psd::")
